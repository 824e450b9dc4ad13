"""Model families, one module each; :mod:`prefixkv.models.registry` lists them."""
