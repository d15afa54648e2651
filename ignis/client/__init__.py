"""ignis/client"""
