"""The memory plan: refuse a start that cannot fit, before anything is allocated (issue 13).

- settings.py: the machine's memory settings file (limit, reserves, weight multiplier)
- probe.py: what the machine has now (host /proc/meminfo, or the GPU through a given query)
- kv.py: a model's KV-cache shape from its GGUF header, and its bytes per token
- need.py: what one model or engine needs (weights, KV, context) and the planned context
- fit.py: the budget and the fit check, with the refusal's wording and numbers
- ledger.py: the claims of running engines, shared by every worker under a file lock
- guard.py: the worker's side: claim a start's memory under the ledger's lock, or refuse it
- overview.py: the plan of named engines without starting anything (`lucia-supervisor plan`)
"""
