"""The operator's page: one HTML document for the owner, served by the gateway under /page/.

- sessions.py: sign-in sessions (cookie token, CSRF token, expiry) and the sign-in rate limit
- sources.py: what the page shows besides the engines: memory, models and traffic, as sources
- memory.py: the memory section: the workers' plans and the ledger's claims against the limit
- routes.py: the page's sub-application: headers, the session and CSRF checks, its JSON API
- static/: index.html, page.js and page.css (no build step, no CDN)
"""
