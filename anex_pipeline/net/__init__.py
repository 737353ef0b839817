"""HTTP helpers shared by every client."""
