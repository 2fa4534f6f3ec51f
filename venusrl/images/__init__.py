"""The image runtime: container images as sandbox roots, with no daemon.

An image is read from an OCI layout, an oci-archive, a docker-archive or a registry
(`reference`, `sources`, `registry`), its layers are unpacked once into a content-addressed cache
that every sandbox shares (`unpack`, `cache`), and `store.ImageStore` hands the sandbox pool an
`Image`: its layer directories, config and users. `build` writes images.
"""
