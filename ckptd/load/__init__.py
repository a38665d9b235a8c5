"""Load planning (chunk intersection) and execution."""
