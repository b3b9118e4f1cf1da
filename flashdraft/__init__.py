"""flashdraft: train, evaluate and serve DFlash drafters for lossless speculative decoding.

Data flow, one subpackage each: data → train → eval → decode/serve.
"""

__version__ = "0.1.0"
