"""Training pipelines for trained drafting parts (SpecDec++ acceptance heads, Medusa heads, CTC drafters)."""
