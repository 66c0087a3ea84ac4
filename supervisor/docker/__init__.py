"""The Docker boundary: the runtime (the only importer of docker), child processes, spec, labels."""
