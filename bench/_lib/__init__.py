"""What the benchmark questions share; a question imports this and the product, never another question."""
