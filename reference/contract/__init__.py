"""The contract: what every hostoffload implementation shares.

A definition is contract when every implementation must agree on it for the two to be interchangeable and for the
conformance suite to compare them: the error classes a misuse raises, what an environment variable accepts, what a
config knob means and which values it refuses, the device interface, the capability vocabulary, which arguments a
call refuses, the fields of a stats value, the bytes of a file on disk. Such a definition is written once, here,
and imported by ``reference``'s oracles, by ``optimized`` and by any third-party implementation.

Everything else in ``reference/`` is an *oracle*: an obviously correct implementation of the semantics, written
only against this package and imported by no implementation, so that a bug in it shows up as a disagreement
instead of being shared. The rule for what belongs here: **a definition both implementations must agree on is
contract; an implementation of the semantics is oracle.** ``conformance.selftest.test_contract_layout`` checks that
``optimized`` imports nothing of ``reference`` but this package, and that this package imports nothing else of
``reference``.

One concept per module (import each by its full path; this package re-exports nothing):

=====================================  ==============================================================
:mod:`~reference.contract.errors`       the error hierarchy (``HostOffloadError``, ``ConfigurationError`` ...)
:mod:`~reference.contract.io_errors`    the swap-I/O errors raised by ``wait()``
:mod:`~reference.contract.envvars`      every ``HOSTOFFLOAD_*`` variable, its parser and the one rule for case
:mod:`~reference.contract.accelerators` the device interface, the shipped ``cpu``/``cuda`` devices, the registry
:mod:`~reference.contract.capabilities` the typed capability declaration of an implementation
:mod:`~reference.contract.implementation` the entry-point descriptor and lazy area loading
:mod:`~reference.contract.interfaces`   the per-area protocols an implementation's modules satisfy
:mod:`~reference.contract.catalog`      every contract class a plugin author meets, by name
:mod:`~reference.contract.pinning_rules` ``PinnedRange``, ``PinnedStats`` and the pinning calls' argument checks
:mod:`~reference.contract.offload_config` ``OffloadConfig`` and its validation
:mod:`~reference.contract.offload_stats` ``OffloadStats`` and the recorder that defines its counters and gauges
:mod:`~reference.contract.accumulation_config` ``AccumulationConfig``/``OptimizerConfig``, DeepSpeed-style input
:mod:`~reference.contract.io_config`    ``SwapConfig`` and its validation
:mod:`~reference.contract.io_stats`     ``SwapStats``
:mod:`~reference.contract.io_record`    the on-disk swap record format
:mod:`~reference.contract.io_temporaries` names of in-progress files and the rule for removing dead writers' ones
:mod:`~reference.contract.io_transfer`  request argument checks and the direct-versus-bounce rule
=====================================  ==============================================================
"""
