"""The model as ops: the op descriptions each family's blocks are written in, the implementation's adaptations, and the priced layer graph."""
