"""What proves and measures an output: `verify` (whole, as its manifest says, decodable, every
input accounted for), `bench` (decode and training-input speed against the raw folder) and
`plots`. May import both sides."""
