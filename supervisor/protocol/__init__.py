"""The file protocol: desired, status and file_sd documents, atomic files, the lease."""
