"""What an image is, apart from its layers: how it is named (a local name or a registry
reference, :mod:`dsec.images.reference`) and what its sandboxes get from it (its config and
start command, :mod:`dsec.images.config`). Light modules: the SDK, the builds engine, the
layer store and the edge all use them."""
