"""Remote objects read by byte range (HTTP, S3), and the Downloader that brings them, verified, into the
download cache."""
