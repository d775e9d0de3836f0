"""Helpers shared by several test modules (pytest puts tests/ on sys.path, so test modules
import them as `from helpers.<module> import ...`). Fixtures every area uses live in conftest.py;
these are the ones only a few modules share."""
