"""The entry points: `runtime serve`, `runtime replay`, `runtime make-model`, `python -m runtime`.

The top floor of the tree: the only part of runtime/ that imports api/ (the HTTP server), so
that neither runtime/ nor api/ depends on how they are started.
"""
