"""What every route of the host's server shares: who is calling, a body read, a refusal."""
