"""Where checkpoints are stored: a local (or shared POSIX) directory, or S3-compatible object storage."""
