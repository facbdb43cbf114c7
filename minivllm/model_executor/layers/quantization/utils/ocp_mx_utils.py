"""OCP microscaling (MX) formats: MXFP4 / MXFP8 share one E8M0 scale per block of this many
values (the Open Compute Project MX specification). Model files size their blocks by it."""

OCP_MX_BLOCK_SIZE = 32
