"""The benchmarks and the load and hostile-input tools they share with the tests, one package: a script run by its
path, `python -m benchmarks.x` and the tests all import them as `benchmarks.x` (the project's install maps the
package to this folder), so none of them edits sys.path."""
