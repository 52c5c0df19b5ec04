//! The model-based property test and the decode-anything fuzz test.
