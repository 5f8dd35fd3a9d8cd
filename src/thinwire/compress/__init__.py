"""What goes on the wire: compressors (fp16/bf16 casting, 1-bit sign+scale) and error feedback."""
