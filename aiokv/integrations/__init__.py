"""Plug-ins that let serving engines use aiokv without forking them.

Each integration lives in its own subpackage and imports its engine only when that
subpackage is imported, so ``import aiokv`` never pulls an engine in.
"""
