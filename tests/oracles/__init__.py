"""Reference implementations the tests check the toolkit against, transcribed from the projects they come from."""
