"""One module per attention backend, each defining ``BACKEND`` (the contract: :mod:`.base`);
:mod:`thdpack.attention.select` holds the table of them and chooses between them."""
