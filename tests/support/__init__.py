"""Builders, oracles and checks that tests in several directories share (``from support.thd_cases
import P5``).

Importable from every test directory (pytest puts tests/ on sys.path for its conftest.py) and from
spawned ranks (spawn copies the parent's sys.path). A helper that serves one directory's tests
only stays beside them (``tests/unit/plan/plan_reference.py``, ``tests/integration/short_records.py``).
"""
