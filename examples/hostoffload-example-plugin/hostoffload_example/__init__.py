"""An out-of-tree hostoffload implementation, registered by entry point.

A vendor shipping its own implementation declares which areas it provides and points each at a module with the
area's API. This example provides pinning and ranges by reusing the reference modules, which is a legitimate
starting point for a port: the suite then checks the vendor's accelerator underneath them. It also declares an
optimizer kernel of another library's (``hostoffload_example.kernels``: torch.optim's Adam, within a declared
tolerance), which the suite judges against R16 on its own.
"""

from reference.contract.capabilities import Capabilities
from reference.contract.implementation import Implementation

IMPLEMENTATION = Implementation(
    name="example",
    version="0.1.0",
    areas={
        "pinning": "reference.pinning",
        "ranges": "reference.ranges",
        "optimizer_kernels": "hostoffload_example.kernels",
    },
    capabilities=Capabilities(
        pin_backends=("torch", "native"),
        # Its areas are the reference modules, which the suite runs in-process for hostoffload itself; a port
        # with native code of its own keeps the default (True) so that a crash fails one test, not the run.
        crash_isolation=False,
    ),
)
