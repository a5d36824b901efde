"""Export: engine folders built from one key table per engine, checked before they are written."""
