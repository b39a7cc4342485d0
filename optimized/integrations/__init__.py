"""Integrations of the optimized engine with training frameworks (optional extras).

Each integration lives in a module of its own that imports without its framework installed: the framework is
imported when the integration is used, and its absence is then a
:class:`~reference.contract.errors.MissingDependencyError` naming the extra to install. So ``optimized`` never
depends on a framework, and a test environment without one still imports every module.

- :mod:`optimized.integrations.lightning` -- ``ZeroStrategy``, a Lightning 2.x ``Strategy`` that trains a
  ``LightningModule`` with :class:`~optimized.accumulation.ZeroEngine` (``pip install 'hostoffload[lightning]'``;
  docs/zero.md, "Lightning").
"""
