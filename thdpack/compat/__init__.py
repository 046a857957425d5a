"""Drop-in replacements for other frameworks' packing functions (``thdpack.compat.nemo``)."""
