"""One module per attention backend; :mod:`thdpack.attention.select` chooses between them."""
