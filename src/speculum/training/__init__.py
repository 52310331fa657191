"""Training pipelines for trained drafting parts (acceptance heads; later CTC drafters and Medusa heads)."""
