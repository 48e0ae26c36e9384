"""Small helpers with no gpuvigil knowledge."""
