"""Key rewrites (strip-module, add-module, rename, convert, retag): plan, apply, result."""
