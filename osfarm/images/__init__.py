"""Desktop images: recipes in vm_images/, built with `osfarm image build` (see build.py)."""
