"""Moving chunks between tiers: every copy (`transfer.py`, one queued copy: `copies.py`), moves down to make room
(`placement.py`), up for a step (`swap_in.py`), chosen chunks to a named tier (`relocation.py`), their totals
(`moves.py`) and a session out of one store into another (`migration.py`). Import the module you need."""
