"""The plugin machinery: how a pytest session becomes a conformance run.

Finding implementations and accelerators (:mod:`.discovery`), the session's options and profiles, the report and
its rule ledger, capability marks and expectation files, crash isolation and the rank pool the distributed tests
run in, the checks of the docs' rules and examples. Nothing here knows an area's rules; the areas' helpers are in
:mod:`conformance.areas`, the fault and trace tools in :mod:`conformance.faults`.
"""
