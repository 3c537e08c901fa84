"""Test helpers: child processes the tests drive (peer.py, pipeline_driver.py,
weights_owner.py), the scripted engine (a test double, see its docstring), and
small functions shared by tests. Nothing here ships with rlix_async."""
