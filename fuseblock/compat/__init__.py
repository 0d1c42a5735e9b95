"""Drop-in entries with other libraries' signatures on top of fuseblock's ops (flash_attn.py)."""
