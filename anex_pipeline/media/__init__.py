"""Media referenced by URL: finding references, the address policy, the cached downloader."""
