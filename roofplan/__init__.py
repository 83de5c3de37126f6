"""roofplan's app layer: the Python API (``roofplan.api``), the ``plan``, ``validate`` and
``hardware`` commands, the rich report, plots and the advice when nothing fits.

It sits on top of the one-way flow (hardware <- planner <- search / validate <- roofplan) and is
the only layer that imports both ``search`` and ``validate`` (lazily: ``plan`` without
``--validate`` never imports torch).
"""
