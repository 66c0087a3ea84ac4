"""The Docker boundary, the only package that imports docker: API, build child, spec, labels."""
