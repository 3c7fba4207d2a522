"""Device kernels behind the embedding layer's plain-torch code.

- ``dynarec.kernels.cpu``: a small C++ extension (compiled once per machine with torch's
  ``cpp_extension``, cached) for the CPU hot spots of dynamic tables. Every function equals its
  plain-torch twin bit for bit; where the extension cannot be built, the plain-torch code runs.
"""
