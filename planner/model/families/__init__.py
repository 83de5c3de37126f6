"""One package per model family, as torchtitan keeps one per family (``torchtitan/models/<family>/``):
each holds its transformers ``config.json`` reader and its registration (``reader.FAMILY``), its
config pieces (sub-configs, the defaults a model file of the family leaves out) and the
description of its own blocks. ``registry`` lists every family; ``config_json`` reads a file
through it.

The packages' ``__init__`` files import nothing, so importing one module of a family runs no other.
"""
