"""ignis/engine"""
