"""User state dicts in ckptd's vocabulary: what each value is, and what is stored where."""
