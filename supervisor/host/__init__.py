"""The host side: unprivileged; reads and writes files and never touches Docker or an engine."""
