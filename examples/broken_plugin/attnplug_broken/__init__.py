"""A deliberately broken attnplug plugin: importing ``attnplug_broken.plugin`` raises."""
