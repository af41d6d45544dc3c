"""What the Triton attention kernels can take, as plain numbers: the selector reads them without importing Triton,
and the Triton backend checks each call against them."""

TRITON_HEAD_DIM_MULTIPLE = 8  # the kernels pad head_dim to a power of two inside, masking the padding
TRITON_MAX_HEAD_DIM = 256
FP8_MIN_CAPABILITY = (8, 9)  # Triton converts float8 e4m3 only on Ada / Hopper and later
