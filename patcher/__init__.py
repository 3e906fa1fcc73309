"""Pure codecs: diff, encode, decode, fold and apply bit-level patches. No I/O here."""
