"""`kvferry bench peers`: kvferry against vLLM's CPU engine (see command.py)."""
