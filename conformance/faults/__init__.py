"""Fault and trace tools: what the suite injects into, or observes of, the process around an implementation --
filesystem faults and call traces at the Python boundary, the chaos accelerator's reorderable streams, and the
attribute patches they are built on.
"""
