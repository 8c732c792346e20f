"""Model families defined outside src/, registered by the tests that use them."""
