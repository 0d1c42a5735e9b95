"""Drop-in entries with other libraries' signatures on top of fuseblock's ops (flash_attn.py,
mamba_ssm.py), and `patch(package)`, which puts them in place in every module of the
package (patch.py)."""
from .drop_ins import patch

__all__ = ["patch"]
