"""The SGLang plugin (``--comm-backend purlin``): entry point ``purlin_sglang.sglang.plugin:register``.

Importing this package (or ``.plugin``) does not import SGLang; the hooks import it when
they run. See docs/SGLANG.md for the SGLang facts the plugin relies on.
"""
